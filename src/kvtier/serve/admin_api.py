"""The admin API (``/admin/*``) and ``/metrics``: the operator's side of a live kvtier server.

Owns ``build_router(service, config)`` and the admin request bodies. Routes (all ``/admin/*``
need ``Authorization: Bearer <server.admin_key>``; with no admin key they answer 403
``admin_disabled``, see ``kvtier.serve.auth``):

- ``GET /admin/storage``: store tiers (URL with secrets redacted, backend, pages, bytes, cap,
  health, binding generation) and the host pool.
- ``PUT /admin/storage`` ``{"tier", "url", "max_bytes"?}``: attach a store; ``DELETE
  /admin/storage?tier=...``: detach it. Both answer 409 with the queued and running counts
  unless the server is idle.
- ``POST /admin/storage/resize`` ``{"tier", "max_bytes"}``: new cap, no idleness needed; a
  shrink evicts and answers once the store fits. ``POST /admin/storage/clear`` ``{"tier"}``.
- ``POST /admin/flush``: drop the device and host tiers. ``POST /admin/host/resize``
  ``{"pool_bytes"}``: rebuild the host pool (idle only).
- ``GET /admin/stats``: the full snapshot as JSON; ``GET /admin/bindings``: generations and a
  fresh coherence check.
- ``GET /metrics``: Prometheus text (``kvtier.metrics``); open unless ``server.api_key`` is set.

Byte counts accept integers or sizes such as ``"512MiB"``. Runs on the server's event loop; the
work itself runs on the engine thread (``AdminOps``). (No ``from __future__ import
annotations``: FastAPI reads the route annotations.)
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from kvtier.config import KvtierConfig
from kvtier.units import parse_size

Tier = Literal["disk", "remote"]
MAX_URL_CHARS = 2048


def _byte_count(value: int | str) -> int:
    parsed = parse_size(value) if isinstance(value, str) else value
    if parsed is None:
        raise ValueError(f"{value!r} is not a byte count (say 1073741824, 512MiB or 4GB)")
    if parsed < 1:
        raise ValueError("must be at least 1 byte")
    return parsed


#: An integer, or a size such as "512MiB".
ByteCount = Annotated[int | str, AfterValidator(_byte_count)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AttachRequest(_Body):
    tier: Tier
    url: str = Field(min_length=1, max_length=MAX_URL_CHARS,
                     description="Store URL: file:///path, redis://[:password@]host:port/db, "
                                 "memory://name")
    max_bytes: ByteCount | None = Field(None, description="Byte cap (file and memory stores)")


class ResizeRequest(_Body):
    tier: Tier
    max_bytes: ByteCount


class TierRequest(_Body):
    tier: Tier


class HostResizeRequest(_Body):
    pool_bytes: ByteCount


def build_router(service: Any, config: KvtierConfig) -> Any:
    from fastapi import APIRouter, Depends, Request
    from fastapi.responses import Response

    from kvtier.metrics import CONTENT_TYPE, render_metrics
    from kvtier.serve.admin_ops import AdminOps
    from kvtier.serve.auth import admin_guard, check_exposure, metrics_guard

    check_exposure(config)
    ops = AdminOps(service, config)
    router = APIRouter()

    @router.get("/metrics", tags=["metrics"], dependencies=[Depends(metrics_guard(config))],
                response_class=Response)
    async def metrics(request: Request) -> Response:
        snapshot = await ops.snapshot(getattr(request.app.state, "limits", None))
        return Response(render_metrics(snapshot), media_type=CONTENT_TYPE)

    admin = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(admin_guard(config))])
    _storage_routes(admin, ops)
    _tier_routes(admin, ops)
    router.include_router(admin)
    return router


def _storage_routes(admin: Any, ops: Any) -> None:
    from fastapi import Query

    @admin.get("/storage")
    async def storage() -> dict[str, Any]:
        return await ops.storage()

    @admin.put("/storage")
    async def attach(body: AttachRequest) -> dict[str, Any]:
        return await ops.attach(body.tier, body.url, body.max_bytes)

    @admin.delete("/storage")
    async def detach(tier: Tier = Query(..., description="disk or remote")) -> dict[str, Any]:
        return await ops.detach(tier)

    @admin.post("/storage/resize")
    async def resize(body: ResizeRequest) -> dict[str, Any]:
        return await ops.resize(body.tier, body.max_bytes)

    @admin.post("/storage/clear")
    async def clear(body: TierRequest) -> dict[str, Any]:
        return await ops.clear(body.tier)


def _tier_routes(admin: Any, ops: Any) -> None:
    from fastapi import Request

    @admin.post("/flush")
    async def flush() -> dict[str, Any]:
        return await ops.flush()

    @admin.post("/host/resize")
    async def host_resize(body: HostResizeRequest) -> dict[str, Any]:
        return await ops.rebuild_host(body.pool_bytes)

    @admin.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        return await ops.snapshot(getattr(request.app.state, "limits", None))

    @admin.get("/bindings")
    async def bindings() -> dict[str, Any]:
        return await ops.bindings()

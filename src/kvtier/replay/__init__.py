"""Trace replay: real request traces through the real index, policies and tier capacities.

``trace`` reads and writes block-level traces, ``synthetic`` makes workloads of other shapes,
``simulator`` replays a trace through ``RadixIndex`` (bookkeeping only, no bytes), ``bound``
computes the offline (future-knowing) bound, ``savings`` prices the result in prefill GPU time
with the planner's cost model. Everything here is pure Python and runs on the main thread.
"""

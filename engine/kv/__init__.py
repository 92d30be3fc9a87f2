"""KV storage bookkeeping: block pool, paged block tables, dense buffers. Plain Python over ints."""

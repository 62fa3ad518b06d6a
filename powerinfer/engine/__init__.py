"""Running a model in this process: the placement and VRAM budget (`plan`, `budget`), a process's
share of a model (`partial`), the KV cache (`kv`), continuous batching, sampling, structured
output and tools, the native layer loop (`native`) and the in-process engine (`inprocess`)."""

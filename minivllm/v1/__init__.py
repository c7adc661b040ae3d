"""vLLM's `vllm.v1.*` import paths, as thin re-exports: code written for vLLM runs with `vllm` ->
`minivllm`.

Nothing is implemented under minivllm/v1/: each module names where the real code lives. The README's
"vLLM import paths" table lists them all.
"""

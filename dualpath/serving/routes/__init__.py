"""The HTTP frontend's routers, one per API family, each made for one ``Frontend`` (``router(front)``) and put
together by ``dualpath.serving.app``: ``chat`` and ``completions`` (OpenAI's), ``responses`` (OpenAI's Responses
API), ``models`` (``/v1/models``), ``sglang`` and ``vllm`` (those servers' native endpoints), ``admin`` (weights,
adapters, aborts, pauses, cache flushes) and ``health`` (health, probes and metrics). Every generation runs the
pipeline of ``dualpath.serving.pipeline``; every other route ``utility``'s."""

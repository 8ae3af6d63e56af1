"""`swaserve bench vllm-compare` and `swaserve bench replica-profile`: a running swaserve server
(and vLLM's) under `vllm bench serve`, sharing the model (`model.py`), the servers (`servers.py`),
the client (`client.py`) and the process accounting (`procs.py`)."""

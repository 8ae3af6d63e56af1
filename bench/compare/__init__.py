"""`swaserve bench vllm-compare`, `replica-profile` and `cluster-compare`: running swaserve servers
(and their peers: vLLM's CPU build, Ray Serve LLM over it) under a client, sharing the model
(`model.py`), the peers' venvs (`peers.py`), the servers (`servers.py`), the clients (`client.py`:
`vllm bench serve`; `stream_client.py`: the routing workloads' streams) and the process
accounting (`procs.py`, `foreign_load.py`)."""

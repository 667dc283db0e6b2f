"""The gRPC edge: the worker's InferenceService server (server.py) and its protobuf conversion (convert.py), the
Python client of it (client.py), and the worker's client of the store's control service (store_client.py)."""

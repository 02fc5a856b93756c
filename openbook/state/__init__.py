"""What the processes of a deployment share through Redis: the protocol (key names and codecs,
no I/O: ``redis_protocol``, and the API keys' part, ``api_keys_protocol``) and the code that
speaks it, sync for the retriever and the generator (``shared_state``) and async for the
gateway (``shared_state_aio``, ``api_keys_state_aio``).

Imports :mod:`openbook.security` (every value is sealed) and :mod:`openbook.config` (the Redis
options); torch-free.
"""

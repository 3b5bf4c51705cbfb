"""The Ray Serve application: thin deployments over the ``apt_serve_ray`` engine.

- ``app.py``             the app builder and its validated arguments (``AppArgs``; ``router_options.py``: ``RouterOptions``)
- ``wire.py``            what the deployments send each other (request, stream item, load report, ...)
- ``router.py``          the HTTP ingress (OpenAI API) and Python handle API: endpoints, admission, the engine call
- ``preparation.py``     an OpenAI body -> a validated, tokenised ``EngineRequest`` and its admission ticket
- ``service_classes.py`` named SLO targets and priority, chosen per request (field or header)
- ``responses.py``       stream items -> OpenAI responses, chunks and server-sent events
- ``openai_protocol.py`` OpenAI request models (``api_error.py``: the error body; ``output_constraint.py``: the
                         output-constraint fields; ``openai_objects.py``: responses and stream chunks)
- ``lora_registry.py``   the adapters requests may name; vLLM's load/unload bodies and checks
- ``admission.py``       score-ordered admission while the engines are saturated
- ``request_router.py``  Serve's request router for the engine replicas: where a request fits
- ``engine_replica.py``  one engine per replica: token streaming, load, control calls
- ``streaming.py``       merging what piles up in a stream while Ray is sending
- ``controller.py``      the cluster-wide memory watermarks (hidden-cache ratio, admission)
"""

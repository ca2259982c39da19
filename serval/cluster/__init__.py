"""Replicas on Ray Serve (`serval serve --replicas N`): N engines behind one serval ingress.

Beside the layers, like cli.py: it composes the engine's EngineClient with Ray Serve. The ingress process
keeps the whole text side (api, serving: templates, tokenizer, detokenizer, parsers); each replica process
owns one Engine and its EngineClient and streams token-id events back. Ray is imported only here and only
when --replicas is given, so the single-process server never loads it.

- config.py:  ReplicaConfig, the frozen options of the replica set (no Ray import)
- wire.py:    what crosses between the ingress and a replica (plain picklable values)
- replica.py: EngineReplica, the Ray Serve deployment class that wraps an EngineClient
- router.py:  PrefixRouter, Ray Serve request router: same prompt head -> same replica, else least loaded
- client.py:  ReplicaClient, the ingress's EngineClient look-alike over the deployment handle
- cluster.py: starting (or joining) Ray, deploying the replicas, tearing them down
"""

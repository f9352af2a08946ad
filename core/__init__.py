"""qwen38-stack's ground floor: what both wings stand on and neither owns.

Errors, settings and profiles, atomic writes, hashing and its proofs, identities and
manifests, the one safetensors checkpoint reader, the artifact lock, progress lines and
verify's stat cache. `core` imports nothing from `prepare/`, `entrypoint/` or `bench/`;
`prepare/` imports only `core`; `entrypoint/` imports `core` and `prepare/`
(`tests/unit/test_import_graph.py`).
"""

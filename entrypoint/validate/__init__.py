"""Validators usable against any running deployment (`qwen38 validate`, `entrypoint.cli.validate`).

`apis` proves the API surface for every model id; `clients` drives the official `openai`
and `anthropic` SDKs the way agent harnesses do; `cache_isolation` proves that prefix
caching reuses blocks within an identity and never across base and adapter. Each returns a
`report.Report`.
"""

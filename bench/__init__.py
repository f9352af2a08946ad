"""The benchmarks and the full-scale lab: `qwen38 bench ...` (not shipped in the serving images).

Every performance claim in the docs names a ``qwen38 bench`` command, and each command's
work lives in a module of this package:

- against a running server: the serving workloads c1, c8, agent, users, depth and copy
  (`workloads` builds them from `prompts`, `measurement` runs them, `stats` and `report`
  turn the records into the result document, `provenance` says who served and measured,
  `serving` ties them together) and the watchdog's cost (`watchdog`);
- runs of `qwen38` itself: start-up to a passed gate (`startup`), planning (`plan`),
  SIGTERM mid-stream (`shutdown`);
- the preparation steps at full size: verification (`verify`), int8 requantization
  (`requantize`), the adapter converter (`adapter`, also run as ``python -m bench.adapter
  WORK LAYERS``, its synthetic checkpoint's writer);
- the full-scale lab on a lent GPU (`fullscale`, `fullscale_steps`, `fullscale_run`,
  `fullscale_figures`) and the decode roofline it is set against (`roofline`).

The command line (flags, dispatch, printing) is `bench.commands`; the modules beside it hold
what they measure. The package sits above `core`, `prepare` and `entrypoint`; none of them
imports it (the CLI loads `bench.commands` by name).
"""

"""Starting or joining Ray, the same way for every stage.

What it is for: `ensure_ray(cfg)` joins `cfg.ray_address` (a cluster, "auto") or starts a local
Ray sized by `cfg.ray_num_cpus`. Calling it twice is harmless. It also quietens Ray Data's
per-operator progress bars when stdout is not a terminal, so logs stay readable in CI.
"""

from __future__ import annotations

import os
import sys


def ensure_ray(cfg) -> None:
    import ray

    if ray.is_initialized():
        return
    kwargs = dict(ignore_reinit_error=True, log_to_driver=True, include_dashboard=False)
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)
    else:
        ray.init(num_cpus=cfg.ray_num_cpus, **kwargs)
    ctx = ray.data.DataContext.get_current()
    interactive = sys.stderr.isatty()
    ctx.enable_progress_bars = interactive
    ctx.enable_operator_progress_bars = interactive
    ctx.print_on_execution_start = interactive

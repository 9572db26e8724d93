"""The ``process`` substrate's function-call tier: ``run_code``.

Layout (one job per module):
  zygote.py   the zygote program (runs in its own namespaces) and the frame protocol
  view.py     what a zygote's read-only root holds
  cgroup.py   the pools' cgroups on the daemon's side
  pool.py     zygote processes, pools with a bounded queue, the service
  api.py      the HTTP routes
"""

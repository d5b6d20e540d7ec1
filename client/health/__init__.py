"""One rank's health, in the order it flows:

- ``policy``: thresholds per signal and what each level does (pure; no torch);
- ``probe``: reading sources (NVML, host, disk, the loop, round trips) and the
  ``HealthProbe`` that evaluates them against the policy on its own thread;
- ``heartbeat``: the ``Heartbeat`` thread that carries the verdict to the server;
- ``agent``: the ``HealthAgent`` that turns the probe's actions into requests
  (coordinated snapshots, rollbacks) and the server's replies into decisions at
  the training loop's ``step`` calls; ``rollback``: its rollback half.

Import from the modules (``from ckptd.client.health.agent import HealthAgent``):
this file imports nothing, so ``ckptd policy check`` pays only for the policy.
"""

"""The planner: profile the engine, simulate a workload over candidate deployments with a
discrete-event model of the scheduler, and recommend the deployment with the most goodput
under an SLO (``triton-disagg plan``).

Files, in the order a plan is made: ``workload`` (requests: Poisson or a trace file), the
engine's step-cost model and its JSON file (``backend/engine/step_profile.py``, which the
emulated engine waits by too), ``profiler`` (measures one on the real engine), ``simulator``
(instances, aggregated and disaggregated deployments), ``slo``
(attainment and goodput), ``planner`` (candidates, the search, the ``serve`` command line).
"""

"""The planner: profile the engine, simulate a workload over candidate deployments with a
discrete-event model of the scheduler, and recommend the deployment with the most goodput
under an SLO (``triton-disagg plan``).

Files, in the order a plan is made: ``workload`` (requests: Poisson or a trace file),
``profile`` (the step-cost model and its JSON file), ``profiler`` (measures one on the real
engine), ``simulator`` (instances, aggregated and disaggregated deployments), ``slo``
(attainment and goodput), ``planner`` (candidates, the search, the ``serve`` command line).
"""

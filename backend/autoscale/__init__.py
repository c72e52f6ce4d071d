"""The autoscaler (``triton-disagg autoscale``) and what it acts through: it watches a
deployment's membership and metrics, predicts the next interval's load, decides how many prefill
and decode instances the SLO needs, and has actuators (host agents, Kubernetes) start and drain
them."""

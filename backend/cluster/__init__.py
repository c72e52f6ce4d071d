"""Cluster membership: instances register signed records in etcd under leases; routers watch them."""

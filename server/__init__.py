"""smddpd, the per-node daemon: rendezvous of a node's ranks, op matching and reduction."""

__version__ = "0.1.0"

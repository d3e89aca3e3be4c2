"""smddp's wire contract: stubs generated from smddp.proto (see scripts/gen_protos.py)."""

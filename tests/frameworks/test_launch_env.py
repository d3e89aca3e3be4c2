"""smddp.core.launch_env: torchrun's variables from Open MPI, MPICH/PMI and Slurm's."""

from __future__ import annotations

import pytest

from smddp.core import launch_env
from smddp.core.launch_env import expand_nodelist, expand_tasks_per_node, fill, port_for


def test_open_mpi_one_node() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
        "PMIX_NAMESPACE": "273416193",
        "PMIX_RANK": "2",
    }
    assert fill(env) is None
    assert env["RANK"] == "2" and env["WORLD_SIZE"] == "3"
    assert env["LOCAL_RANK"] == "2" and env["LOCAL_WORLD_SIZE"] == "3"
    assert env["MASTER_ADDR"] == "127.0.0.1"
    assert env["MASTER_PORT"] == str(port_for("273416193"))
    assert (
        launch_env.PORT_BASE
        <= int(env["MASTER_PORT"])
        < launch_env.PORT_BASE + launch_env.PORT_SPAN
    )


def test_mpich_pmi() -> None:
    env = {
        "PMI_RANK": "1",
        "PMI_SIZE": "4",
        "MPI_LOCALRANKID": "1",
        "MPI_LOCALNRANKS": "2",
        "PMI_KVSNAME": "kvs_77_0",
        "MASTER_ADDR": "head",
        "MASTER_PORT": "1234",
    }
    assert fill(env) is None
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "1",
        "4",
        "1",
        "2",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("head", "1234")  # the user's are kept


def test_slurm_across_nodes_uses_first_node_of_the_step() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "7",
        "SLURM_STEP_NUM_TASKS": "7",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "SLURM_STEP_NUM_NODES": "4",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "gpu[07-09],cpu1",
    }
    assert fill(env) is None
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "5",
        "7",
        "1",
        "2",
    )
    assert env["MASTER_ADDR"] == "gpu07"
    assert env["MASTER_PORT"] == str(port_for("4242.0"))


def test_sagemaker_hosts_across_nodes() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "16",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
        "SM_HOSTS": '["algo-1", "algo-2"]',
        "OMPI_MCA_ess_base_jobid": "99",
    }
    assert fill(env) is None
    assert env["MASTER_ADDR"] == "algo-1" and env["LOCAL_RANK"] == "0"
    env2 = {
        "OMPI_COMM_WORLD_RANK": "9",
        "OMPI_COMM_WORLD_SIZE": "16",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
        "SM_MASTER_ADDR": "10.0.0.5",
        "SM_HOSTS": '["algo-1", "algo-2"]',
    }
    fill(env2)
    assert env2["MASTER_ADDR"] == "10.0.0.5" and env2["LOCAL_RANK"] == "1"


def test_across_nodes_without_a_host_says_what_to_set() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    problem = fill(env)
    assert problem is not None and "MASTER_ADDR" in problem and "Open MPI" in problem
    assert "MASTER_ADDR" not in env


def test_torchrun_variables_win() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"}
    assert fill(env) is None
    assert env == {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "3",
    }


def test_no_launcher_leaves_everything() -> None:
    env = {"HOME": "/root"}
    assert fill(env) is None and env == {"HOME": "/root"}


@pytest.mark.parametrize(
    ("compact", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("a[1-2]-b[8-9]", ["a1-b8", "a1-b9", "a2-b8", "a2-b9"]),
        ("r[098-101]", ["r098", "r099", "r100", "r101"]),
    ],
)
def test_expand_nodelist(compact: str, hosts: list[str]) -> None:
    assert expand_nodelist(compact) == hosts


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]

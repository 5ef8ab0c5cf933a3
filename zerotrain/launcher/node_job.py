"""What one node of a multi-node job runs: the description the launcher sends each node agent.

It travels as one JSON line (on the agent's stdin over ssh, or base64 in its argv
under srun), so values of environment variables and arguments reach the node
exactly, without passing through a shell.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import asdict, dataclass, field

# Every process of a job carries these two variables: teardown and stack dumps find the
# processes of one job on one node by them, never by name.
JOB_ID_ENV = "ZEROTRAIN_JOB_ID"
NODE_RANK_ENV = "ZEROTRAIN_NODE_RANK"
# How the agent tells the launcher its node's result: one line on stdout starting with this.
RESULT_MARK = "@@zerotrain-node-result "
# A line the launcher sends an agent to have every rank of its node print its Python stack.
DUMP_STACKS_COMMAND = "dump-stacks"


@dataclass(frozen=True)
class NodeJob:
    """Everything a node agent needs to start its node's ranks under torch's elastic agent."""

    job_id: str
    """Tags every process of the job (JOB_ID_ENV) so teardown finds exactly these."""
    host: str
    """The node's name as the hostfile spells it: the prefix of its ranks' output lines."""
    node_rank: int | None
    """Position in the job; None: read it from the scheduler (SLURM_NODEID) on the node."""
    nnodes: int
    """Number of nodes (the maximum, with elastic training)."""
    nproc: int
    """Ranks on this node."""
    master_addr: str
    """Where node 0 hosts the rendezvous store, as every node can reach it."""
    master_port: int
    """The rendezvous port on `master_addr`."""
    cwd: str
    """Working directory of the ranks: the launching node's."""
    target: str
    """Script path, module name (`module`) or program (`no_python`)."""
    target_args: tuple[str, ...] = ()
    """Arguments passed on to the target."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for every rank of the job (exports, .deepspeed_env, --env)."""
    slots: tuple[int, ...] | None = None
    """GPU indices for CUDA_VISIBLE_DEVICES on GPU nodes; None: 0..nproc-1."""
    module: bool = False
    """Run the target as `python -m`."""
    no_python: bool = False
    """Run the target as a program, not through Python."""
    local_rank_arg: bool = True
    """Pass --local_rank=K to the target, as DeepSpeed's launcher does."""
    elastic: bool = False
    """Elastic training: c10d rendezvous, nodes may leave and the job goes on."""
    min_nodes: int | None = None
    """Fewest nodes an elastic job keeps running with."""
    max_restarts: int = 0
    """How many times the agent restarts its workers after a failure (elastic jobs)."""
    bind_cores: bool = False
    """Give each rank its own share of the node's cores (--bind_cores_to_rank)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> NodeJob:
        data = json.loads(text)
        for name in ("target_args", "slots"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        return cls(**data)

    def to_b64(self) -> str:
        """The job as one shell-safe word (for srun / mpirun command lines)."""
        return base64.urlsafe_b64encode(self.to_json().encode()).decode()

    @classmethod
    def from_b64(cls, word: str) -> NodeJob:
        return cls.from_json(base64.urlsafe_b64decode(word.encode()).decode())

    def resolved_node_rank(self, environ: dict[str, str] | None = None) -> int:
        """The node rank: as given, else from the scheduler's variables on this node."""
        if self.node_rank is not None:
            return self.node_rank
        env = os.environ if environ is None else environ
        for name in ("SLURM_NODEID", "OMPI_COMM_WORLD_NODE_RANK", "GROUP_RANK"):
            if name in env:
                return int(env[name])
        raise RuntimeError("this node's rank is not set and no scheduler variable (SLURM_NODEID) gives it")

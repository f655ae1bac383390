"""Argument lists for the Slurm programs clusterops starts itself: job steps (``srun``)
inside an allocation, and the ``sbatch`` line a submission runs.

The supervisor's training and check steps, its stack captures, the distributed probe and
the sweep's node pairs all start ``srun``; the launcher shows the ``sbatch`` command it
runs. Their argv lists are built here, as pure functions, so the Slurm boundary holds:
no module outside ``clusterops/slurm/`` spells a Slurm program in an argv (a test reads
the source tree to keep it so). Each function returns the bare program name first;
``SlurmTools.argv`` turns it into the prefix's path where a site set one.
"""

from __future__ import annotations

from typing import List, Optional, Sequence


def srun_argv(command: Sequence[str], *, job_name: Optional[str] = None,
              nodes: Optional[Sequence[str]] = None, ntasks_per_node: Optional[int] = None,
              ntasks: Optional[int] = None, cpus_per_task: Optional[int] = None,
              jobid: Optional[str] = None, overlap: bool = False,
              kill_on_bad_exit: Optional[bool] = None, output: Optional[str] = None,
              error: Optional[str] = None, exclude: Sequence[str] = (),
              extra: Sequence[str] = (), wait_s: Optional[int] = None,
              label: bool = False, no_kill: bool = False) -> List[str]:
    """``srun [options] command...``. ``nodes``: the exact nodes (``--nodes=N
    --nodelist=...``); ``ntasks`` defaults to nodes x ntasks_per_node when both are known.
    ``wait_s``: how long the other tasks may outlive the first to exit (``--wait``);
    ``label``: prefix each output line with its task number (``--label``); ``no_kill``: the
    step outlives a node of it that fails (``--no-kill``: seen on 22.05, a step without it is
    ended on every node once slurmctld marks one of its nodes down; with it the tasks on the
    other nodes run on)."""
    argv = ["srun"]
    if job_name:
        argv.append(f"--job-name={job_name}")
    if jobid:
        argv.append(f"--jobid={jobid}")
    if overlap:
        argv.append("--overlap")
    if nodes:
        argv += [f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}"]
    if ntasks is None and nodes and ntasks_per_node:
        ntasks = len(nodes) * ntasks_per_node
    if ntasks is not None:
        argv.append(f"--ntasks={int(ntasks)}")
    if ntasks_per_node is not None:
        argv.append(f"--ntasks-per-node={int(ntasks_per_node)}")
    if cpus_per_task:
        argv.append(f"--cpus-per-task={int(cpus_per_task)}")
    if kill_on_bad_exit is not None:
        argv.append(f"--kill-on-bad-exit={1 if kill_on_bad_exit else 0}")
    if no_kill:
        argv.append("--no-kill")
    if wait_s is not None:
        argv.append(f"--wait={int(wait_s)}")
    if label:
        argv.append("--label")
    if exclude:
        argv.append(f"--exclude={','.join(exclude)}")
    if output:
        argv.append(f"--output={output}")
    if error:
        argv.append(f"--error={error}")
    argv += list(extra)
    return argv + list(command)


def standby_step_argv(command: Sequence[str], node: str, *, job_name: str, jobid: Optional[str] = None,
                      cpus_per_task: Optional[int] = None, extra: Sequence[str] = (),
                      ntasks: int = 1) -> List[str]:
    """``ntasks`` tasks on ``node`` in a step of their own inside the running job, sharing the
    resources of the training step already there (``--overlap``): warm standbys of in-process
    recovery, started in a used one's place or on a spare node. Their own failure ends
    nothing else."""
    return srun_argv(command, job_name=job_name, jobid=jobid, nodes=[node], ntasks=ntasks, ntasks_per_node=ntasks,
                     cpus_per_task=cpus_per_task, overlap=True, kill_on_bad_exit=False, label=True, extra=extra)


def sbatch_argv(script: str, args: Sequence[str] = (), *, parsable: bool = True) -> List[str]:
    """``sbatch [--parsable] [args...] script``: what a submission runs."""
    return ["sbatch"] + (["--parsable"] if parsable else []) + list(args) + [script]

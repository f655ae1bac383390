"""The ranks' own words in a step log (srun --label): traceback last lines and hardware signs."""

from __future__ import annotations

import pytest

from clusterops.slurm.parse import parse_srun_failures
from clusterops.supervisor.evidence import TaskOutput, first_error, read_task_output, sign_of

# Two nodes, one rank each: rank 0 raised, srun ended rank 1 (--kill-on-bad-exit).
TWO_RANKS = """\
0: step 1
1: step 1
0: Traceback (most recent call last):
0:   File "/work/train.py", line 12, in <module>
0:     main()
0:   File "/work/train.py", line 9, in main
0:     opt.load_state_dict(state["optim"]["state"])
0:                         ~~~~~~~~~~~~~~^^^^^^^^^
0: KeyError: 'state'
srun: error: node1: task 0: Exited with exit code 1
srun: launch/slurm: _step_signal: Terminating StepId=7.0
slurmstepd: error: *** STEP 7.0 ON node1 CANCELLED AT 2026-12-04T06:50:01 ***
srun: error: node2: task 1: Terminated
srun: Force Terminated StepId=7.0
"""


def test_traceback_last_line_of_the_failed_rank_only():
    said = read_task_output(TWO_RANKS)
    assert said == {0: TaskOutput(error="KeyError: 'state'")}
    fails, _ = parse_srun_failures(TWO_RANKS)
    assert first_error(said, [f.rank for f in fails]) == (0, "KeyError: 'state'")


def test_chained_exceptions_give_the_last_and_padded_labels_are_read():
    text = "\n".join([
        "12: Traceback (most recent call last):",
        '12:   File "a.py", line 1, in <module>',
        "12: FileNotFoundError: [Errno 2] No such file or directory: '/data/shard-12'",
        "12: ",
        "12: During handling of the above exception, another exception occurred:",
        "12: ",
        "12: Traceback (most recent call last):",
        '12:   File "a.py", line 3, in <module>',
        "12: RuntimeError: shard 12 missing",
        " 3: Traceback (most recent call last):",
        ' 3:   File "a.py", line 5, in <module>',
        " 3: ValueError: bad batch",
    ])
    said = read_task_output(text)
    assert said[12].error == "RuntimeError: shard 12 missing"
    assert said[3].error == "ValueError: bad batch"


def test_a_launcher_wrapper_error_does_not_hide_the_childs():
    text = "\n".join([
        "0: [rank0]: Traceback (most recent call last):",   # not the head: torchrun prefixes its own
        "0: Traceback (most recent call last):",
        '0:   File "train.py", line 3, in <module>',
        "0: ZeroDivisionError: division by zero",
        "0: Traceback (most recent call last):",
        '0:   File "/usr/lib/python3/dist-packages/torch/distributed/run.py", line 9, in main',
        "0: torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ])
    assert read_task_output(text)[0].error == "ZeroDivisionError: division by zero"


def test_torch_rank_prefixed_tracebacks_are_read():
    # torch.distributed's exception hook writes "[rankN]: " before every line (torch 2.13,
    # seen on the dev cluster): rank 1 raised, rank 0 then lost its gloo peer.
    text = "\n".join([
        "1: [rank1]: Traceback (most recent call last):",
        '1: [rank1]:   File "user_ddp.py", line 28, in <module>',
        '1: [rank1]:     raise RuntimeError(f"scratch on {a.raise_on_node} is not writable")',
        "1: [rank1]: RuntimeError: scratch on node2 is not writable",
        "0: [rank0]: Traceback (most recent call last):",
        '0: [rank0]:   File "user_ddp.py", line 34, in <module>',
        "0: [rank0]:     loss.backward()",
        "0: [rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer",
        "srun: error: node2: task 1: Exited with exit code 1",
    ])
    said = read_task_output(text)
    assert said[1].error == "RuntimeError: scratch on node2 is not writable"
    assert said[0].error.startswith("RuntimeError: [../third_party/gloo")


@pytest.mark.parametrize("line,name", [
    ("RuntimeError: CUDA error: an illegal memory access was encountered", "cuda_error"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
     "nccl_error"),
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.", "xid"),
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "cuda_error"),
    ("uncorrectable ECC error detected on GPU 3", "ecc_error"),
    ("an illegal memory access was encountered", "illegal_memory_access"),
    ("ncclSystemError: System call (e.g. socket, malloc) or external library call failed", "nccl_error"),
    ("cudaErrorLaunchFailure: unspecified launch failure", "cuda_error"),
])
def test_hardware_signs_by_name(line, name):
    assert sign_of(line) == name


@pytest.mark.parametrize("line", [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "RuntimeError: CUDA error: out of memory",
    "RuntimeError: CUDA error: device-side assert triggered",
    "KeyError: 'state'",
    "loss 2.31 at step 100 (xidx)",
])
def test_the_programs_own_cuda_errors_and_plain_errors_are_no_sign(line):
    assert sign_of(line) is None


def test_sign_and_error_of_one_rank_and_unlabelled_lines_ignored():
    text = "\n".join([
        "srun: error: CUDA error in srun's own line is not a rank's",
        "1: Traceback (most recent call last):",
        '1:   File "train.py", line 40, in step',
        "1: RuntimeError: CUDA error: an illegal memory access was encountered",
        "srun: error: node2: task 1: Exited with exit code 1",
    ])
    said = read_task_output(text)
    assert set(said) == {1}
    assert said[1].error == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert said[1].sign == ("cuda_error", "RuntimeError: CUDA error: an illegal memory access was encountered")


def test_long_messages_are_clipped_to_one_line():
    said = read_task_output("0: Traceback (most recent call last):\n0:   File x\n0: ValueError: " + "x" * 500)
    assert len(said[0].error) == 200 and said[0].error.endswith("...")


# The tail of a real step log (examples/plain_env_ddp.py, 2 nodes x 2 ranks, on the dev
# cluster under load): rank 1's gloo worker thread dropped the last reference to a
# finished collective while the interpreter was shutting down (core dump: the thread
# killed in take_gil inside ~AsyncWork, a noexcept destructor), and the C++ runtime
# aborted the process after the script had returned 0.
TEARDOWN_ABORT = """\
0: done steps=60 out=/tmp/plain-env/final.pt
1: terminate called without an active exception
srun: error: node1: task 1: Aborted (core dumped)
srun: launch/slurm: _step_signal: Terminating StepId=1.0
srun: error: node1: task 0: Terminated
srun: error: node2: tasks 2-3: Terminated
srun: Force Terminated StepId=1.0
"""


def test_a_cpp_terminate_is_the_tasks_error_and_srun_says_it_aborted():
    said = read_task_output(TEARDOWN_ABORT)
    assert said == {1: TaskOutput(error="terminate called without an active exception")}
    fails, _ = parse_srun_failures(TEARDOWN_ABORT)
    assert [(f.rank, f.aborted) for f in fails] == [(1, True), (0, False), (2, False), (3, False)]
    assert not any(f.aborted for f in parse_srun_failures("srun: error: n1: task 0: Killed\n"
                                                          "srun: error: n1: task 1: Segmentation fault\n")[0])


def test_an_uncaught_cpp_exception_gives_its_what_and_the_later_of_traceback_and_abort_wins():
    text = "\n".join([
        "2: Traceback (most recent call last):",
        '2:   File "train.py", line 4, in <module>',
        "2: ValueError: handled and printed, then the run went on",
        "2: terminate called after throwing an instance of 'c10::Error'",
        "2:   what():  bad optional access",
        "3: terminate called without an active exception",
        "3: Traceback (most recent call last):",
        '3:   File "train.py", line 9, in <module>',
        "3: RuntimeError: after the abort line",
    ])
    said = read_task_output(text)
    assert said[2].error == "terminate called after throwing an instance of 'c10::Error': bad optional access"
    assert said[3].error == "RuntimeError: after the abort line"

"""MINIVLLM_CPU_OMP_THREADS_BIND (cpu_hardware.bind_cpu_threads): off by default, a CPU list pins every thread,
"auto" pins only on an idle machine. Binding runs in a child process: it would pin the test runner too."""

import json
import os
import subprocess
import sys

import pytest

from minivllm.platforms.cpu_hardware import bind_cpu_threads, parse_cpu_list

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


def in_child(setting: str, idle_load: float = 0.5) -> dict:
    code = ("import json, os, threading, torch; from minivllm.platforms.cpu_hardware import bind_cpu_threads; "
            "t = threading.Thread(target=lambda: None); "
            f"cpus = bind_cpu_threads({setting!r}, {idle_load!r}); "
            "tasks = {int(n): sorted(os.sched_getaffinity(int(n))) for n in os.listdir('/proc/self/task')}; "
            "print(json.dumps(dict(cpus=cpus, tasks=list(tasks.values()), threads=torch.get_num_threads())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_lists_parse_like_taskset():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    with pytest.raises(ValueError, match="MINIVLLM_CPU_OMP_THREADS_BIND"):
        bind_cpu_threads("cores please")


def test_off_by_default_and_a_list_pins_every_thread(monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert bind_cpu_threads() is None
    first = min(os.sched_getaffinity(0))
    res = in_child(str(first))
    assert res["cpus"] == [first] and res["threads"] == 1
    assert all(mask == [first] for mask in res["tasks"])  # every thread, not only the caller


def test_auto_pins_only_an_idle_machine():
    assert in_child("auto", idle_load=-1.0)["cpus"] is None  # "busy": placement stays with the OS
    assert in_child("auto", idle_load=1e9)["cpus"] == sorted(os.sched_getaffinity(0))

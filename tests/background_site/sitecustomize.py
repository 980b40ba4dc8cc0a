"""Imported at start-up by every Python process of a launch the test suite reads later (pretrain_driver.Background
puts this directory on PYTHONPATH): such a launch runs at the lowest priority, beside the tests.

Its processes inherit SCHED_IDLE, but that orders tasks only within one autogroup (Linux groups the tasks of a
session and shares the CPU between groups as equals): torchrun starts every rank in a session of its own, so its
ranks took half a core from the tests whenever they were busy (the quick subset: 48 s alone, 63 s beside the
pretrain_gpt.py driver, 17 s of it waiting for a core). A process that leads its session gives its autogroup the
lowest weight (nice 19), as `echo 19 > /proc/self/autogroup` would; where there are no autogroups, nothing changes.
"""
import os

if os.getsid(0) == os.getpid():
    try:
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write("19")
    except OSError:
        pass

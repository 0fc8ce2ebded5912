"""The clocks, in one place: a step's compute and wait (``step``), the host CPU time left out of emulated native time (``host``), training time less pauses (``train``)."""

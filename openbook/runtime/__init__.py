"""The CPU a process gets and the torch threads sized to it: how much CPU the process may use
and how much its neighbours take (``cpu_budget``), and torch's compute threads sized to that and
resized as it changes (``compute_threads``, issue 29); the loaded heap frozen out of the
garbage collector's walks (``heap``).

Imports nothing of openbook; torch only inside :mod:`~openbook.runtime.compute_threads`.
"""

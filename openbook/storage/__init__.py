"""What openbook publishes to disk and how: directories published atomically with a manifest of
every file's sha256 (``artifacts``: indexes, checkpoints, the demo's models), and the format of
fine-tuned checkpoints over it (``checkpoint``: layout, manifest, find, verify; the parts' own
code sits beside what it composes, in :mod:`openbook.rag.checkpoint` and
:mod:`openbook.index.checkpoint`).

Imports :mod:`openbook.validation` (a checkpoint's name) and ``openbook.errors``; stdlib only,
no torch.
"""

"""What a request may carry, checked once at each boundary: every limit and text rule
(``limits``), the metadata filter grammar with its meaning on one record
(``metadata_filter``), and one line of a JSON Lines file as an object (``jsonl``: passages,
questions and training examples read the same everywhere). The gateway's schemas, the
retriever's and the generator's servicers and the library's own entry points all check against
these, so what one boundary accepts every other accepts.

Imports only the top-level leaves (``openbook.errors``); torch-free and framework-free.
"""

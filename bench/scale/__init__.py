"""The scale bench (``python -m bench.scale``): what one save and one resume cost each rank at N ranks.

A Llama-2-7B-shaped state (291 fp32 weights and their Adam state, :mod:`~bench.scale.llama`), in
two layouts, ``ddp`` (every rank holds everything) and ``fsdp2`` (``DTensor`` ``Shard(0)`` over N
ranks), is saved and resumed for N in 8, 64, 512, 1,024 and 8,192 by simulating two ranks of N
in one process: rank 0 (which coordinates and publishes) and rank 1 (any other rank).

**Driven for real** (the library's and torch's own code, unchanged): the save path from
``parts.checkpoint_parts`` (torch's ``get_state_dict``, the optimizer's capture and its gather,
the model plan ``pieces.make_plan`` and its gather, RNG and data position) through
``writer.write_checkpoint`` (staging, every part: ``model_io.save_model`` with its file plan,
``shard_files.index_doc`` and ``write_rank_files``, rank 0's ``shard_index.json``;
``optim_io.save_optimizer`` with ``optim_files`` or DCP's ``dcp.save`` with its planner, global
plan and ``.metadata``; the records gather to rank 0), ``writer.publish`` (manifest, directory
fsyncs, rename, ``LATEST``), ``LOWEST_VAL`` and retention's choice (``retention.plan_prune``,
``set_aside``), the verdict, and rank 0's share of the background deletion
(``retention.delete_files`` of its own files, ``remove_set_aside`` once the other ranks, made
here, deleted theirs); the resume path
``remove_leftovers``, ``reader.find_resume_point`` (``choose``, the manifest, each rank checking the sizes of its 1/N of the files),
``loading.inline_files``, ``reader.checking_while_loading`` (its digest share ``reader._share``),
``loading.load_state`` (``model_io.load_model``: ``read_layout``, ``read_aliases``,
``load_by_slices`` or the whole-shard reads; ``optim_io.load_optimizer``: the skeleton, torch's
optimizer state-dict functions, ``optim_files.load`` or DCP's ``dcp.load`` with its
``.metadata`` read and load plan), and the RNG file. Metadata calls are counted as they happen
(:mod:`~bench.scale.probe`); the checkpoint's files exist on disk at their real sizes.

**Synthetic**:

* the other ranks' contributions to every gather (:mod:`~bench.scale.sim`): made from rank 0's
  with torch's shard arithmetic, and the other ranks' files made by the library's own per-rank
  writers with their inputs (:class:`~bench.scale.save.PeerFiles`); rank 1's real contribution is
  compared with what was made for it, and any difference fails the cell;
* the tensor bytes (:mod:`~bench.scale.sparse`): files are sparse, with the real safetensors
  headers; the readers parse the headers and count the bytes they would read; the resume's
  digests are accounted (which rank would read which file), not computed; tensors are
  ``torch.empty`` (untouched) or ``meta``; the ``ddp`` model is the module DDP would wrap;
* an older checkpoint (hard links to the same files) for retention to remove, as at every save of
  a long run;
* above ``--dcp-max-ranks`` (1,024) the ``fsdp2`` state is saved and resumed without its
  optimizer: DCP's coordinator holds every rank's plan (4.5 GB at 1,024 here). The optimizer's
  part measured at 1,024 is added to those figures, which are then lower bounds.

**Capped**: the resume's digest-share planning (``reader._share``, O(files x N)) stops after
``--cap-s`` seconds; its time is then a lower bound and an exact heap-based equivalent
(:func:`~bench.scale.resume.fast_share`) gives the share so the resume goes on. A cell stopped at
``--cell-limit-s`` keeps what it measured, as lower bounds.

Figures are CPU seconds of one rank (``time.process_time`` less the simulation's own work) and
bytes; see bench/README.md for each key and the table.
"""

"""The subcommands of ``hpctrain`` (the entry point and its dispatch: ``hpctrain/cli.py``), one module per
area: each has ``add_parser(sub)`` (an argparse sub-parser whose ``func`` runs the command and returns its
exit code) and imports the area's heavy modules inside the command, so ``hpctrain --help`` stays fast.

``info`` (tools/info.py), ``bench`` (bench/), ``train``, ``checkpoint`` (``ckpt``), ``profiling``
(``trace``), ``sweep``, ``data``, ``tools`` (``generate``), ``interop`` (``export``, ``import-hf``;
``peft``: ``export --format peft``, ``import-peft``), ``plan``, ``monitor`` (``runs``).

This layer sits on top of every library layer (hpctrain/layers.py): a library package never imports a
command, so its own layer is only as high as its library code needs.
"""

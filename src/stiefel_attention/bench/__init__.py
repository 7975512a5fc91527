"""The benchmark suite: the paper's experiments on the library (`pip install stiefel-attention[bench]`).

Layers, bottom up: data and tasks (`cifar10`, `modular`), the suite's models (`models`) and arms
(`arms`, on the library's public API); experiment families (`cifar`, `grok`, each registered in
`family`); run records and executors (`records`, `runner`); statistics, claims and reports
(`stats`, `claims`, `report` and each family's `*_report`); the `stiefel-attention` command (`cli`).
The library (`stiefel_attention`) never imports this package.
"""

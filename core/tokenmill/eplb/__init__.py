"""Expert-parallel load balancing (EPLB): redundant copies of the hottest experts, rebalanced while serving.

Under expert parallelism (``enable_expert_parallel``) each rank runs the token-expert pairs of
the experts it holds, so the rank holding the most popular experts sets every step's pace. With
``enable_eplb`` a MoE layer's ``E`` *logical* experts (the checkpoint's) become ``E + R``
*physical* ones, ``(E + R) / n`` slots on each of the ``n`` ranks: ``R`` redundant slots hold
second (third, ...) copies of the experts that were routed the most tokens.

* :mod:`tokenmill.eplb.config`: the options (``eplb_config``) and the checks at start;
* :mod:`tokenmill.eplb.placement`: which logical expert each physical slot holds, from the
  measured load (pure Python, no torch);
* :mod:`tokenmill.layers.expert_replicas`: a layer's slots and the routing of each token-expert
  pair to one of its expert's copies;
* :mod:`tokenmill.eplb.rebalance`: the worker-side loop that measures the load over a window of
  steps and, every ``step_interval`` steps, moves expert weights between ranks.
"""

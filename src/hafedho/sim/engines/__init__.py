"""Engines run one round's cohort: every client's update, streamed into the algorithm's aggregator.

``loop`` is the reference: a plain Python loop, any ``nn.Module``. Faster engines must agree with it:

* ``process``: the cohort spread over a persistent pool of single-threaded worker processes; same results as
  ``loop`` up to float rounding, bit-identical for any number of workers.
* ``vmap``: ``torch.func.vmap`` over chunks of the cohort (on a GPU when there is one); same results as ``loop``
  up to float rounding for dropout-free models.
* ``auto``: ``vmap`` on a GPU, ``process`` on a multi-core CPU, ``loop`` otherwise.

Every engine adds the uploads into the aggregator in cohort order, so the float64 sums see the same
sequence of additions whatever the engine's internal schedule.

"Up to float rounding" means the bound of ``tests/tolerance.py`` (a few eps per operation, growing with the
reduction length and the number of steps) for smooth models. With ReLU or max pooling, a rounding difference
can flip a near-tie (one unit of one example), which moves that unit's gradient by O(1) in one step; engines
then agree in distribution (same accuracy), not to a float bound, and the tests compare smoothed models.

Modules: one per engine (``loop``, ``process``, ``vmap``), each on ``hafedho.runtime.work`` (the ``Engine``
protocol, ``RoundWork``, ``CohortStream``, ``CohortResult``) and none on another; ``hafedho.engine_registry``
(``ENGINES``, ``OPTIONS``) names them by module path, below the config, which reads it for its help and options;
``make`` (``make_engine``, ``engine_for``, ``auto``) builds them by that name, or a user's engine by reference.
This file imports nothing.
"""

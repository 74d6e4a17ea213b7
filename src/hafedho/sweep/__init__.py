"""Experiment presets and multi-seed sweeps: expand a preset into run configs, run the missing ones in parallel.

A preset (an installed plugin's ``NAME``, e.g. the paper study's ``table1``, or your own file) is TOML::

    extends = "_common"          # optional: a preset in the same folder, deep-merged under this one
    description = "..."
    seeds = 3                    # default for --seeds (seeds 0..n-1)
    out = "results/paper"        # sweep folder; "-SCALE" is appended (results/paper-cpu)
    [base]                       # an ordinary hafedho config; dotted keys are allowed anywhere
    [grid]                       # axis -> values; one run per point of the cartesian product and seed
    "data.q" = [0.1, 0.3]        #   a config key, or
    dataset = ["femnist"]        #   a named axis: each value selects the overrides in [bundles.dataset.VALUE]
    [bundles.dataset.femnist]    # overrides for one value of a named axis
    [[variants]]                 # labelled extra points, e.g. the centralised baseline:
    label = "centralized"        #   its row label in reports
    cross = ["dataset"]          #   grid axes it is crossed with (the others do not apply to it)
    reference = true             #   shown, but never bold and never a competitor
    set = {...}                  #   its overrides
    [[variants]]                 # a derived row: one run beside every run of another row
    label = "ROW-derived"        #   its row label
    of = "ROW"                   #   the row it follows (its label); no other keys but derive
    derive = "my_pkg.rows:derive"  # a function cfg -> (the [algorithm] table, or None, and why not)
    [report]                     # how `hafedho report` shows it (metric, last, targets, names, title; the study:
                                 #   own, reference, derived rows' reading: hafedho.report.study)
    [scale.cpu] / [scale.full]   # a partial preset merged over this one for --scale (cpu is the default);
                                 # its [grid] replaces the axes it names

One run's config: base < named-axis bundles < config-key axes < variant ``set`` < command-line overrides;
then ``seed``, ``name`` and ``out`` are set, and only the selected algorithm's ``[algorithm.NAME]`` table is kept
(``hafedho.algorithms.applicable``; the others never apply to the run).

A derived variant adds, right after every run of the row ``of`` names (its label, so a variant of that algorithm
with another label gets none), one run with that run's config and seed and ``[algorithm]`` replaced by what
``derive(cfg)`` returns (the function is named by reference, ``hafedho.core.refs``, and receives the run's
validated config). It has its row's grid point and is named as any run of its algorithm (``ALG-SOURCE-HASH-sSEED``),
so an identical run elsewhere is the same directory (within a preset it is listed under both row labels). Where
``derive`` returns None, the sweep index's ``notes`` say why there is none, and the report shows them under the
final table. The paper study's momentum twin (``hafedho_paper.twin``, a plugin: ``study/`` in this repository) is
one.

Run directories are ``OUT/LABEL-SOURCE-HASH-sSEED``, the name ``hafedho run`` gives (``Config.run_name`` with
``name = LABEL-SOURCE``; LABEL is the algorithm, or a variant's label): HASH is the experiment's identity
(``hafedho.config.experiment_hash``: data, partition, clients, sampling, model, resolved algorithm; never the
engine, workers, threads, checkpoint cadence or ``rounds``), so identical runs of different presets, and a plain
``hafedho run`` of the same experiment, share one directory, and a changed experiment never resumes a stale
run. ``OUT/sweeps/PRESET.json`` lists the runs of the latest sweep of that preset for ``hafedho report``.

Modules, in import order: ``presets`` (read and merge a preset file), ``expand`` (preset -> ``RunSpec`` list),
``execute`` (run the specs: skip, resume, parallel workers), ``ray_backend`` (each run a task on a Ray
cluster; imported only for ``--backend ray``), ``index`` (the sweep index's format, the one module
of the sweep the report imports).
"""

"""Flower integration: any registered algorithm on Flower's deployment and simulation engines.

    hafedho.flower.server_app:app   the ServerApp (``HafedhoStrategy``: the algorithm's server half)
    hafedho.flower.client_app:app   the ClientApp (the algorithm's ``client_update``, state in ``context.state``)
    hafedho.flower.codec            lossless pytree <-> ArrayRecord encoding
    hafedho.flower.app              the run config (keys, defaults) and the App's pyproject.toml
    hafedho.flower.deploy           start/stop SuperLink and SuperNodes (procs, certs, flwr_cli: ``flwr run``)

Needs the ``flower`` extra (``pip install 'hafedho[flower]'``); importing this package alone does not import flwr.
See docs/flower.md and examples/flower/.
"""

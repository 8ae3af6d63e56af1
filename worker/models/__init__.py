"""Model implementations (one flat file per architecture), their registry (`worker.models.registry`)
and loader (`worker.models.loader`).

The package itself imports nothing, so `worker.models.spec` (which the attention backends need)
can be imported without the models, which import the attention backends. Importing the loader
does not import transformers; it does so lazily for configs.
"""

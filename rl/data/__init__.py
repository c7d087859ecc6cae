"""The data layer: reading and validating training data (files, saved datasets, Hub repositories,
streaming, mixtures, eval splits) and turning its rows into token batches for SFT and for preference
training (DPO and reward models); every bad row is one `DataError` naming its file and line. It may
import the layers below it (rl.engine, rl.algos, rl.config) and rl.errors; it never imports rl.models
or anything above, which read their data through it.
"""

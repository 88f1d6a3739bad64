"""Data preparation: datatrove reads documents, tokenises and packs them into webdataset shards + manifest.

The entry points are data_prep.build.prepare (what `prism prepare` runs) and data_prep.manifest.verify.
"""

"""The study's verdict: paired tests and scaling fits; torch-free."""

"""The sweep: the Optuna study loop (controller.py), its samplers, the rule that stops it, the
leaders measured again, the storage shared by workers, the progress it prints."""

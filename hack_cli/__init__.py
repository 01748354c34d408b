"""The `hack` command line. Only argument parsing lives here; each command imports its
implementation lazily so that `hack --help` stays fast."""

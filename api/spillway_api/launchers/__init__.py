"""Where jobs run: `local` (a child process on this machine) and `kubernetes` (a FineTuneJob object)."""

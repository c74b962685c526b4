"""The communication logger: counts, sizes, latency and bandwidth of every collective.

* the ``comms_logger`` config section (:mod:`.config`) turns it on for an engine
  (:mod:`.plugin` registers it as an observer);
* :class:`~.logger.CommsRecorder` keeps the records of what :mod:`dsplug.comm` reports through the
  ``dsplug_comm_op`` hook and prints the summary behind ``dsplug.comm.log_summary()``.

Importing this package is cheap (no torch).
"""

"""The verdict stage: the run directory and its readers, validation of a finished run, the report, the
post-mortem of a run that did not finish, and the model's evaluation on whole volumes.

Importing this package imports neither TensorFlow nor matplotlib (Ansible's filter plugin imports
``postmortem`` on a controller without the kit's runtime).
"""

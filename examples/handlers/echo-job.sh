#!/bin/sh
# A demo command handler: prints the job it was given and succeeds.
# Jobs whose first argument is "fail" exit 1, to show a failure record.
payload=$(cat)
echo "job $LOCKETD_CLASS from $LOCKETD_QUEUE: $payload (lock $LOCKETD_LOCK_KEYS)"
case "$LOCKETD_ARGS" in
  '["fail"'*) echo "asked to fail" >&2; exit 1 ;;
esac

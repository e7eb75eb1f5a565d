#!/usr/bin/env bash
# Start the local services the integration tests talk to, where they are installed but not running.
# (Debian packages, as on the development and CI machines; in docker-compose they are containers.)
set -u
if command -v pg_isready >/dev/null && ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
fi
if command -v redis-cli >/dev/null && ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
fi
for _ in $(seq 30); do
  ok=1
  command -v pg_isready >/dev/null && ! pg_isready -h 127.0.0.1 -p 5432 -q && ok=0
  command -v redis-cli >/dev/null && ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && ok=0
  [ "$ok" = 1 ] && exit 0
  sleep 1
done
echo "ensure-services: PostgreSQL or Redis did not come up" >&2

# Redis 7 from Debian's packages: the stand-in for redis:7 where no container registry can be reached. Same
# contract as the public image for docker-compose.yml: `redis-server` and `redis-cli` on PATH, data in /data.
ARG DEBIAN_IMAGE=distillq-debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Protected mode off by default, as in the public image (a container's clients are never on its loopback); a
# configuration file or flag given to redis-server still decides.
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data /usr/local/etc/redis \
    && chown redis:redis /data \
    && printf 'protected-mode no\n' > /etc/redis/docker-defaults.conf \
    && printf '%s\n' '#!/bin/sh' \
        'conf=$(mktemp) && cat /etc/redis/docker-defaults.conf > "$conf"' \
        'if [ -f "${1:-}" ]; then echo "include $1" >> "$conf"; shift; fi' \
        'exec /usr/bin/redis-server "$conf" "$@"' > /usr/local/bin/redis-server \
    && chmod 755 /usr/local/bin/redis-server
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--dir", "/data"]

#!/usr/bin/env bash
# Runs once, when the postgres volume is first initialised (docker-entrypoint-initdb.d):
# one login role + database per service, so MLflow and Prefect never use the superuser.
# Passwords are read from the environment inside psql (\getenv), never put on a command line.
set -euo pipefail

psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres <<'SQL'
\getenv mlflow_user MLFLOW_DB_USER
\getenv mlflow_password MLFLOW_DB_PASSWORD
\getenv mlflow_db MLFLOW_DB_NAME
\getenv prefect_user PREFECT_DB_USER
\getenv prefect_password PREFECT_DB_PASSWORD
\getenv prefect_db PREFECT_DB_NAME
CREATE ROLE :"mlflow_user" LOGIN PASSWORD :'mlflow_password';
CREATE DATABASE :"mlflow_db" OWNER :"mlflow_user";
CREATE ROLE :"prefect_user" LOGIN PASSWORD :'prefect_password';
CREATE DATABASE :"prefect_db" OWNER :"prefect_user";
\connect :"prefect_db"
-- Prefect's migrations use trigram indexes; create the extension as superuser up front.
CREATE EXTENSION IF NOT EXISTS pg_trgm;
SQL

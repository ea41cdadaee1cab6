//! The JSON Schema of the config format (feature `config`): the shipped
//! `schema/ratelimit-config.schema.json` is what `config::json_schema()` generates (this test
//! also writes it: `UPDATE_SCHEMA=1 cargo test --features config --test config_schema`), it is a
//! valid draft 7 schema, every example config passes it, bad files fail it (and the loader refuses
//! them too, so the schema is never stricter than the loader), and its defaults are the loader's.

use crate::common;

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tower_redis_ratelimit::config::{RateLimitConfig, json_schema};

/// The shipped schema, relative to the crate root.
const SHIPPED: &str = "schema/ratelimit-config.schema.json";

/// The top-level fields the demo keeps for itself.
const APP_FIELDS: [&str; 2] = ["listen", "metrics"];

fn shipped_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(SHIPPED)
}

/// The schema as the file holds it: pretty-printed, with a trailing newline.
fn schema_text(schema: &Value) -> String {
    serde_json::to_string_pretty(schema).unwrap() + "\n"
}

#[test]
fn the_shipped_schema_is_the_generated_one() {
    let generated = json_schema();
    let path = shipped_path();
    if std::env::var_os("UPDATE_SCHEMA").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, schema_text(&generated)).unwrap();
        eprintln!("wrote {}", path.display());
        return;
    }
    let shipped = std::fs::read_to_string(&path)
        .map_err(|error| error.to_string())
        .and_then(|text| serde_json::from_str::<Value>(&text).map_err(|error| error.to_string()));
    let problem = match shipped {
        Ok(shipped) if shipped == generated => return,
        Ok(_) => "differs from what config::json_schema() generates".to_owned(),
        Err(error) => format!("can't be read as JSON ({error})"),
    };
    panic!(
        "{SHIPPED} {problem}: the config types or their doc comments changed. Regenerate it with\n\n    \
         UPDATE_SCHEMA=1 cargo test --features config --test config_schema\n\nand commit the new file."
    );
}

#[test]
fn the_schema_is_a_valid_draft_7_schema_with_its_title_and_id() {
    let schema = json_schema();
    jsonschema::meta::validate(&schema).unwrap();
    assert_eq!(schema["$schema"], "http://json-schema.org/draft-07/schema#");
    assert_eq!(schema["title"], "tower-redis-ratelimit configuration");
    assert_eq!(schema["$id"], "urn:tower-redis-ratelimit:config");
    // The top level is open for the app's fields, and says so; `other` is no field of the file.
    assert_eq!(schema.get("additionalProperties"), None);
    assert!(
        schema["description"]
            .as_str()
            .unwrap()
            .contains("The top level is open")
    );
    assert_eq!(schema["properties"].get("other"), None);
    assert_eq!(schema["required"], json!(["routes"]));
}

/// `(definition, its fields)`: every table below the top level takes exactly these fields.
const CLOSED_TABLES: &[(&str, &[&str])] = &[
    (
        "RouteConfig",
        &[
            "path",
            "paths",
            "name",
            "key",
            "algorithm",
            "rules",
            "prevent_duplicate",
            "block_for",
            "mode",
            "max_delay",
            "cost_header",
            "count_only",
            "prefetch",
            "max_in_flight",
            "lease",
            "overrides",
            "meter",
        ],
    ),
    ("RuleConfig", &["limit", "period", "burst", "metered"]),
    (
        "MeterConfig",
        &[
            "unit",
            "estimate",
            "estimate_header",
            "usage_header",
            "max_usage",
        ],
    ),
    ("DuplicateRule", &["limit", "period"]),
    (
        "OverrideConfig",
        &["identity", "cidr", "rules", "unlimited", "deny"],
    ),
    (
        "QuotaConfig",
        &[
            "key",
            "tier_header",
            "default_tier",
            "tiers",
            "alert_at",
            "alert_webhook",
            "utc_offset",
            "metered",
        ],
    ),
    ("StoreTable", &["cluster", "sentinel", "master"]),
];

fn property_names(object: &Value) -> Vec<&str> {
    let mut names: Vec<&str> = object["properties"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    names.sort_unstable();
    names
}

#[test]
fn nested_tables_are_closed_and_every_field_is_described() {
    let schema = json_schema();
    let definitions = schema["definitions"].as_object().unwrap();
    for (name, fields) in CLOSED_TABLES {
        let table = &definitions[*name];
        assert_eq!(table["additionalProperties"], false, "{name}");
        let mut expected = fields.to_vec();
        expected.sort_unstable();
        assert_eq!(property_names(table), expected, "{name}");
    }
    let mut top_level = vec![
        "store",
        "prefix",
        "on_store_error",
        "store_timeout",
        "trusted_proxies",
        "forwarded_header",
        "legacy_headers",
        "tls_ca",
        "tls_insecure",
        "wait_for_replicas",
        "routes",
        "quota",
    ];
    top_level.sort_unstable();
    assert_eq!(property_names(&schema), top_level);

    // Doc comments became descriptions, one line each.
    let tables = std::iter::once(("the top level", &schema)).chain(
        CLOSED_TABLES
            .iter()
            .map(|(name, _)| (*name, &definitions[*name])),
    );
    for (table, object) in tables {
        for (field, property) in object["properties"].as_object().unwrap() {
            let description = property["description"].as_str().unwrap_or_default();
            assert!(
                description.len() > 10 && !description.contains('\n'),
                "{table}.{field}: {description:?}"
            );
        }
    }
    // The documented defaults, never serde's `null` for a field left out.
    let text = schema.to_string();
    assert!(!text.contains(r#""default":null"#), "{text}");
    assert_eq!(schema["properties"]["prefix"]["default"], "rl");
    assert_eq!(schema["properties"]["store"]["default"], "memory");
}

#[test]
fn store_and_prevent_duplicate_are_a_string_or_bool_or_a_table() {
    let schema = json_schema();
    let definitions = &schema["definitions"];
    let store = &definitions["StoreConfig"]["anyOf"];
    assert_eq!(store[0]["type"], "string");
    assert_eq!(
        store[1]["allOf"][0]["$ref"], "#/definitions/StoreTable",
        "{store}"
    );
    let duplicate = &definitions["DuplicateConfig"]["anyOf"];
    assert_eq!(duplicate[0]["type"], "boolean");
    assert_eq!(
        duplicate[1]["allOf"][0]["$ref"], "#/definitions/DuplicateRule",
        "{duplicate}"
    );
    // Durations are strings, with examples.
    let period = &definitions["RuleConfig"]["properties"]["period"];
    assert_eq!(period["type"], "string");
    assert!(period["description"].as_str().unwrap().contains("1h30m"));
    assert!(!period["examples"].as_array().unwrap().is_empty());
}

/// A TOML document as the JSON the schema is about.
fn json_of(toml_text: &str) -> Value {
    toml::from_str::<Value>(toml_text).unwrap_or_else(|error| panic!("{error}\n{toml_text}"))
}

/// The schema's complaints about `document`, one per line (empty: valid).
fn schema_errors(document: &Value) -> String {
    let validator = jsonschema::validator_for(&json_schema()).unwrap();
    validator
        .iter_errors(document)
        .map(|error| format!("{}: {error}", error.instance_path()))
        .collect::<Vec<_>>()
        .join("\n")
}

fn load(text: &str) -> Result<RateLimitConfig, String> {
    RateLimitConfig::loader()
        .app_fields(APP_FIELDS)
        .from_toml_str(text)
        .map_err(|error| error.to_string())
}

#[test]
fn every_example_config_passes_the_schema() {
    let mut with_app_fields = 0;
    for path in common::example_configs() {
        let text = std::fs::read_to_string(&path).unwrap();
        let document = json_of(&text);
        let errors = schema_errors(&document);
        assert!(errors.is_empty(), "{}:\n{errors}", path.display());
        if APP_FIELDS.iter().any(|field| document.get(field).is_some()) {
            with_app_fields += 1;
        }
    }
    // The demo's `listen` passed: the top level is open.
    assert!(with_app_fields > 0);
}

/// Files that use every field, each loaded by the loader and passed by the schema.
const GOOD: &[&str] = &[
    r#"
listen = "127.0.0.1:3000"
metrics = "127.0.0.1:9091"
store = "memory"
prefix = "app"
on_store_error = "deny"
store_timeout = "1s"
trusted_proxies = ["10.0.0.0/8", "::1"]
forwarded_header = "X-Real-IP"
legacy_headers = true

[[routes]]
path = "/api/ping"
name = "ping"
key = "header:x-api-key"
algorithm = "token_bucket"
rules = [{ limit = 10, period = "1s", burst = 50 }, { limit = 1000, period = "1h30m" }]
prevent_duplicate = { period = "2s", limit = 1 }
block_for = "15m"
mode = "delay"
max_delay = "2s"
cost_header = "x-cost"
max_in_flight = 2
lease = "30s"
overrides = [
  { identity = "admin", unlimited = true },
  { cidr = "192.0.2.0/24", deny = true },
  { identity = "partner", rules = [{ limit = 100, period = "1s" }] },
]

[[routes]]
path = "/work"
key = "query:token"
mode = "shadow"
prevent_duplicate = true
max_in_flight = 1
lease = "10s"

[quota]
key = "user"
tier_header = "x-plan"
default_tier = "free"
tiers = { free = 100, pro = 5000 }
alert_at = [50, 80, 100]
utc_offset = "+05:30"
"#,
    r#"
store = "redis://127.0.0.1:6379/0"
wait_for_replicas = 1

[[routes]]
path = "/a"
key = "global"
prevent_duplicate = false
rules = [{ limit = 1, period = "1d" }]
"#,
];

/// Store tables: the loader reads them only with the features `cluster` / `sentinel`.
const GOOD_STORES: &[(&str, bool)] = &[
    (
        r#"store = { cluster = ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"] }"#,
        cfg!(feature = "cluster"),
    ),
    (
        r#"store = { sentinel = ["redis://127.0.0.1:26379"], master = "mymaster" }"#,
        cfg!(feature = "sentinel"),
    ),
    (
        r#"store = "rediss://127.0.0.1:6380/0"
tls_insecure = true"#,
        cfg!(feature = "tls"),
    ),
];

const ROUTE: &str = "[[routes]]\npath = \"/a\"\nrules = [{ limit = 5, period = \"1m\" }]\n";

#[test]
fn good_files_pass_both_the_schema_and_the_loader() {
    let stores = GOOD_STORES
        .iter()
        .map(|(store, loads)| (format!("{store}\n{ROUTE}"), *loads));
    let files = GOOD
        .iter()
        .map(|text| (text.to_string(), true))
        .chain(stores);
    for (text, loads) in files {
        let errors = schema_errors(&json_of(&text));
        assert!(errors.is_empty(), "{errors}\n{text}");
        if loads {
            load(&text).unwrap_or_else(|error| panic!("{error}\n{text}"));
        }
    }
}

#[test]
fn bad_files_fail_the_schema_as_the_loader_refuses_them() {
    let route = |line: &str| {
        format!("[[routes]]\npath = \"/a\"\nrules = [{{ limit = 5, period = \"1m\" }}]\n{line}\n")
    };
    let quota = |line: &str| format!("{ROUTE}[quota]\ntiers = {{ free = 100 }}\n{line}\n");
    let cases: Vec<(String, &str)> = vec![
        (route("limmit = 5"), "/routes/0"),
        (
            "[[routes]]\nrules = [{ limit = 5, period = \"1m\" }]\n".to_owned(),
            "/routes/0",
        ),
        (route("paths = [\"/b\", \"c\"]"), "/routes/0/paths/1"),
        (
            "[[routes]]\npaths = []\nrules = [{ limit = 5, period = \"1m\" }]\n".to_owned(),
            "/routes/0/paths",
        ),
        (
            "[[routes]]\npath = \"/a\"\nrules = { limit = 5, period = \"1m\" }\n".to_owned(),
            "/routes/0/rules",
        ),
        (
            "[[routes]]\npath = \"/a\"\nrules = [{ limit = \"5\", period = \"1m\" }]\n".to_owned(),
            "/routes/0/rules/0/limit",
        ),
        (
            "[[routes]]\npath = \"/a\"\nrules = [{ limit = 0, period = \"1m\" }]\n".to_owned(),
            "/routes/0/rules/0/limit",
        ),
        (
            "[[routes]]\npath = \"/a\"\nrules = [{ limit = 5, period = \"1m\", colour = 1 }]\n"
                .to_owned(),
            "/routes/0/rules/0",
        ),
        (
            "[[routes]]\npath = \"/a\"\nrules = [{ limit = 5, period = 60 }]\n".to_owned(),
            "/routes/0/rules/0/period",
        ),
        (route("algorithm = \"leaky_bucket\""), "/routes/0/algorithm"),
        (route("mode = \"turbo\""), "/routes/0/mode"),
        (route("key = \"cookie\""), "/routes/0/key"),
        (route("key = \"header:\""), "/routes/0/key"),
        (
            route("prevent_duplicate = \"yes\""),
            "/routes/0/prevent_duplicate",
        ),
        (
            route("prevent_duplicate = { period = \"2s\", window = 1 }"),
            "/routes/0/prevent_duplicate",
        ),
        (
            route("prevent_duplicate = { period = \"2s\", limit = 2 }"),
            "/routes/0/prevent_duplicate",
        ),
        (
            route("max_in_flight = 0\nlease = \"1s\""),
            "/routes/0/max_in_flight",
        ),
        (
            route("overrides = [{ identity = \"a\", unlimted = true }]"),
            "/routes/0/overrides/0",
        ),
        (
            "[[routes]]\npath = \"api\"\nrules = [{ limit = 5, period = \"1m\" }]\n".to_owned(),
            "/routes/0/path",
        ),
        (
            "[[routes]]\nrules = [{ limit = 5, period = \"1m\" }]\n".to_owned(),
            "/routes/0",
        ),
        ("routes = []\n".to_owned(), "/routes"),
        ("prefix = \"p\"\n".to_owned(), ""),
        (
            format!("on_store_error = \"maybe\"\n{ROUTE}"),
            "/on_store_error",
        ),
        (
            format!("legacy_headers = \"yes\"\n{ROUTE}"),
            "/legacy_headers",
        ),
        (format!("store = 6379\n{ROUTE}"), "/store"),
        (
            format!("store = {{ cluster = [\"redis://127.0.0.1:7000\"], nodes = 3 }}\n{ROUTE}"),
            "/store",
        ),
        (
            format!("wait_for_replicas = -1\n{ROUTE}"),
            "/wait_for_replicas",
        ),
        (quota("colour = \"red\""), "/quota"),
        (quota("alert_at = [0, 100]"), "/quota"),
        (format!("{ROUTE}[quota]\ntiers = {{}}\n"), "/quota"),
        (
            format!("{ROUTE}[quota]\ntiers = {{ free = 0 }}\n"),
            "/quota",
        ),
        (format!("{ROUTE}[quota]\nkey = \"user\"\n"), "/quota"),
    ];
    // `at`: where the schema says the file is wrong (inside an optional table, such as `quota`,
    // the table: each of `anyOf`'s choices, the table or nothing, fails).
    for (text, at) in &cases {
        let errors = schema_errors(&json_of(text));
        assert!(
            errors
                .lines()
                .any(|line| line.starts_with(&format!("{at}: "))),
            "the schema should refuse {at:?}, and said:\n{errors}\nfile:\n{text}"
        );
        assert!(
            load(text).is_err(),
            "the loader accepts what the schema refuses:\n{text}"
        );
    }
}

#[test]
fn the_schema_defaults_are_the_loaders() {
    let schema = json_schema();
    let definitions = &schema["definitions"];
    // Every documented default written out, as TOML lines.
    let defaults = |object: &Value| -> String {
        object["properties"]
            .as_object()
            .unwrap()
            .iter()
            .filter_map(|(field, property)| {
                let default = property.get("default")?;
                let value = toml::Value::try_from(default).unwrap();
                Some(format!("{field} = {value}\n"))
            })
            .collect()
    };
    let top = defaults(&schema);
    let route = defaults(&definitions["RouteConfig"]);
    let quota = defaults(&definitions["QuotaConfig"]);
    for field in [
        "store",
        "prefix",
        "on_store_error",
        "store_timeout",
        "legacy_headers",
    ] {
        assert!(top.contains(&format!("{field} = ")), "{top}");
    }
    for field in ["key", "algorithm", "mode", "prevent_duplicate"] {
        assert!(route.contains(&format!("{field} = ")), "{route}");
    }
    for field in ["key", "tier_header", "alert_at", "utc_offset"] {
        assert!(quota.contains(&format!("{field} = ")), "{quota}");
    }
    let bare = format!("{ROUTE}[quota]\ntiers = {{ free = 100 }}\n");
    let explicit = format!("{top}{ROUTE}{route}[quota]\ntiers = {{ free = 100 }}\n{quota}");
    assert!(schema_errors(&json_of(&explicit)).is_empty(), "{explicit}");
    let (bare, explicit) = (load(&bare).unwrap(), load(&explicit).unwrap());
    // The same settings (store, timeout, prefix, …: what the config shows before its routes,
    // whose entries as written differ) and the same policy.
    let settings = |config: &RateLimitConfig| {
        let text = format!("{config:?}");
        text[..text.find(", routes: [").unwrap()].to_owned()
    };
    assert_eq!(settings(&bare), settings(&explicit));
    let route = |config: &RateLimitConfig| {
        let [route] = config.routes() else {
            panic!("one route")
        };
        (
            route.path().to_owned(),
            route.key().to_owned(),
            format!("{:?}", route.policy()),
        )
    };
    assert_eq!(route(&bare), route(&explicit));
}

/// Every numeric bound of a route, as the schema states it, is the loader's: the bound itself
/// passes both, one past it fails both.
#[test]
fn the_schema_and_the_loader_agree_on_every_numeric_bound_of_a_route() {
    let schema = json_schema();
    let definitions = &schema["definitions"];
    let metered = "[[routes]]\npath = \"/a\"\nrules = [{ limit = 34359738368, period = \"1m\", \
                   metered = true }]\n";
    // (definition, property, a file with the value at `{}`)
    let bounded: [(&str, &str, String); 8] = [
        (
            "RuleConfig",
            "limit",
            "[[routes]]\npath = \"/a\"\nrules = [{ limit = {}, period = \"1m\" }]\n".to_owned(),
        ),
        (
            "RouteConfig",
            "max_in_flight",
            format!("{ROUTE}max_in_flight = {{}}\nlease = \"1s\"\n"),
        ),
        (
            "RouteConfig",
            "prefetch",
            format!("{ROUTE}algorithm = \"fixed_window\"\nprefetch = {{}}\n"),
        ),
        (
            "MeterConfig",
            "estimate",
            format!("{metered}meter = {{ unit = \"tokens\", estimate = {{}} }}\n"),
        ),
        (
            "MeterConfig",
            "max_usage",
            format!("{metered}meter = {{ unit = \"tokens\", estimate = 0, max_usage = {{}} }}\n"),
        ),
        (
            "QuotaConfig",
            "alert_at",
            format!("{ROUTE}[quota]\ntiers = {{ free = 100 }}\nalert_at = [{{}}]\n"),
        ),
        (
            "QuotaConfig",
            "tiers",
            format!("{ROUTE}[quota]\ntiers = {{ free = {{}} }}\n"),
        ),
        (
            "DuplicateRule",
            "limit",
            format!("{ROUTE}prevent_duplicate = {{ period = \"2s\", limit = {{}} }}\n"),
        ),
    ];
    for (definition, property, file) in &bounded {
        let stated = &definitions[definition]["properties"][property];
        // An array's items, or a map's values, carry the bound.
        let stated = [&stated["items"], &stated["additionalProperties"], stated]
            .into_iter()
            .find(|schema| schema.get("maximum").is_some())
            .unwrap_or_else(|| panic!("{definition}.{property} states no maximum: {stated}"));
        let (minimum, maximum) = (
            stated["minimum"].as_u64().unwrap(),
            stated["maximum"].as_u64().unwrap(),
        );
        let with = |value: u64| file.replace("{}", &value.to_string());
        for (value, passes) in [
            (minimum, true),
            (maximum, true),
            (maximum + 1, false),
            (minimum.wrapping_sub(1), false),
        ] {
            if value == u64::MAX {
                continue; // (no number below a minimum of 0)
            }
            let text = with(value);
            let schema_passes = schema_errors(&json_of(&text)).is_empty();
            let loader_passes = load(&text).is_ok();
            assert_eq!(
                (schema_passes, loader_passes),
                (passes, passes),
                "{definition}.{property} = {value}: the schema {} and the loader {}\n{text}",
                if schema_passes { "passes" } else { "refuses" },
                if loader_passes { "passes" } else { "refuses" },
            );
        }
    }
}

#[test]
fn a_max_usage_below_the_estimate_is_refused_naming_both() {
    let text = "[[routes]]\npath = \"/a\"\nrules = [{ limit = 1000, period = \"1m\", metered = true \
                }]\nmeter = { unit = \"tokens\", estimate = 500, max_usage = 10 }\n";
    let error = load(text).expect_err("max_usage below the estimate");
    assert!(
        error.contains("meter.max_usage") && error.contains("meter.estimate"),
        "{error}"
    );
    let text = text.replace("max_usage = 10", "max_usage = 500");
    load(&text).expect("max_usage at the estimate");
}

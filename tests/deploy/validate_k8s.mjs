// Validates Kubernetes objects against the API's OpenAPI schemas, offline: each object's model
// from the npm package kubernetes-models (the schemas compiled into validators), found under
// the directory given as the first argument (scripts/install-k8s-tools puts it in
// /opt/gpusnap/k8s-tools). kubectl cannot do this without an API server to fetch the schemas from.
//
// The compiled validators check types, enums and required fields but let unknown fields pass
// (the API's schemas do not close their objects; the API server drops such fields, or refuses
// them under strict field validation). A misspelt field ("readinessProb") is refused here too:
// every object's keys are checked against the fields its type declares in the package's type
// declarations (*.d.ts), which list each type's fields.
//
// Usage: node validate_k8s.mjs MODULES_DIR < objects.json   (a JSON array of objects)
// Prints one line per problem, "KIND NAME: PATH MESSAGE"; exits 1 when there is one.
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = join(process.argv[2], "node_modules");
const models = join(modules, "kubernetes-models");
const objects = JSON.parse(readFileSync(0, "utf8"));
let problems = 0;

// Every declared type's fields: {typeName: {field: typeText}}, under the interface's own name
// and the names it is exported as ("IContainer" is also "IIoK8sApiCoreV1Container").
function declaredTypes() {
  const types = {};
  const files = [];
  const walk = (dir) => {
    for (const e of readdirSync(dir, { withFileTypes: true })) {
      if (e.isDirectory()) walk(join(dir, e.name));
      else if (e.name.endsWith(".d.ts")) files.push(join(dir, e.name));
    }
  };
  walk(models);
  walk(join(modules, "@kubernetes-models", "apimachinery"));
  for (const file of files) {
    const text = readFileSync(file, "utf8");
    const local = {};
    for (const m of text.matchAll(/^export interface (\w+)[^{\n]*\{\n([\s\S]*?)\n\}/gm)) {
      const fields = {};
      for (const f of m[2].matchAll(/^    "([^"]+)"\??: (.*)$/gm)) fields[f[1]] = f[2].replace(/;$/, "");
      local[m[1]] = fields;
      if (m[1].startsWith("IIoK8s")) types[m[1]] = fields;
    }
    for (const m of text.matchAll(/^export type \{ ([^}]+) \}/gm)) {
      for (const pair of m[1].split(",")) {
        const [name, alias] = pair.trim().split(/\s+as\s+/);
        if (alias && local[name]) types[alias] = local[name];
      }
    }
    types[file] = local;
  }
  return types;
}
const types = declaredTypes();

// The keys of `value` that its type does not declare, as paths; follows declared types of
// fields, and arrays of them, into nested objects (maps and plain types are not followed).
function unknownFields(value, fields, path, out) {
  if (value === null || typeof value !== "object" || Array.isArray(value)) return;
  for (const [key, child] of Object.entries(value)) {
    if (!(key in fields)) {
      out.push(`${path}/${key}: unknown field`);
      continue;
    }
    const m = fields[key].match(/^(?:Array<)?(I\w+)>?$/);
    const nested = m && types[m[1]];
    if (!nested) continue;
    const items = Array.isArray(child) ? child : [child];
    items.forEach((item, i) =>
      unknownFields(item, nested, Array.isArray(child) ? `${path}/${key}/${i}` : `${path}/${key}`, out));
  }
}
for (const object of objects) {
  const name = `${object.kind} ${object.metadata?.name ?? "(no name)"}`;
  // apps/v1 -> apps/v1/DaemonSet.js; v1 (the core group) -> v1/Pod.js.
  const file = join(models, ...String(object.apiVersion).split("/"), `${object.kind}.js`);
  let Model;
  try {
    Model = (await import(pathToFileURL(file).href))[object.kind];
  } catch {
    console.log(`${name}: no schema for ${object.apiVersion} ${object.kind}`);
    problems++;
    continue;
  }
  try {
    new Model(object).validate();
  } catch (e) {
    console.log(`${name}: ${e.message}`);
    problems++;
  }
  const fields = (types[file.replace(/\.js$/, ".d.ts")] || {})[`I${object.kind}`];
  if (!fields) {
    console.log(`${name}: no declared fields for ${object.apiVersion} ${object.kind}`);
    problems++;
    continue;
  }
  const unknown = [];
  unknownFields(object, fields, "data", unknown);
  for (const u of unknown) console.log(`${name}: ${u}`);
  problems += unknown.length;
}
process.exit(problems ? 1 : 0);

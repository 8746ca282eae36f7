// Validates Kubernetes objects against the API's OpenAPI schemas, offline: each object's model
// from the npm package kubernetes-models (the schemas compiled into validators), found under
// the directory given as the first argument (scripts/install-k8s-tools puts it in
// /opt/gpusnap/k8s-tools). kubectl cannot do this without an API server to fetch the schemas from.
//
// Usage: node validate_k8s.mjs MODULES_DIR < objects.json   (a JSON array of objects)
// Prints one line per problem, "KIND NAME: PATH MESSAGE"; exits 1 when there is one.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const models = join(process.argv[2], "node_modules", "kubernetes-models");
const objects = JSON.parse(readFileSync(0, "utf8"));
let problems = 0;
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
}
process.exit(problems ? 1 : 0);
